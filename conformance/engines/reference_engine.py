"""The `reference` engine: refmodel run in float32 on a bundle's own weights.

It is the CI-side proof that a correct fp32 engine passes the bundle's tolerances, and the engine that
fault injection (conformance/engines/faults.py) wraps. Implements conformance.engines.protocol.Engine, teacher forcing
included (run_layer feeds a layer its golden input and golden cache rows), the optional held routing
(`hold_routing`: the next forward runs the given expert sets, as refmodel's `forced_ids` does for the
profiles' noise measurements) and the optional live DDTree (`ddtree_generate`: refmodel/ddtree.py's loop
in float32 with the bundle's own drafter, its router always free).
"""
from __future__ import annotations

import contextlib
import os

import numpy as np

from conformance.records import LIVE_BUDGET, live_records
from kdtr_format import open_kdtr
from refmodel.config import ModelConfig
from refmodel.ddtree import (Tree, build_ddtree, cost_aware_nodes, draft_logits, prefill, prune_tree,
                             verify_cost_table, verify_round)
from refmodel.drafter import read_drafter
from refmodel.model import KVCache, block, causal_mask, expert_weights, forward, rope_cos_sin
from refmodel.stored import read_model, upcast_if_fits


@contextlib.contextmanager
def refmodel_swapped(functions: dict):
    """refmodel.model's functions named in `functions` replaced by those values inside the block, restored
    after it however it ends: how the planted-mistake and honest-variant engines change one step of the
    reference (conformance/engines/mistakes.py, honest.py)."""
    import refmodel.model as rm

    saved = {k: getattr(rm, k) for k in functions}
    try:
        for k, v in functions.items():
            setattr(rm, k, v)
        yield
    finally:
        for k, v in saved.items():
            setattr(rm, k, v)


class ReferenceEngine:
    name = "reference"
    dtype = "float32"
    supports_teacher_forcing = True

    def __init__(self, dtype=np.float32):
        self.np_dtype = dtype
        self.cfg: ModelConfig | None = None
        self.W: dict = {}
        self.cache: KVCache | None = None
        self._held_ids: dict = {}             # layer -> [T, K] expert ids for the next forward (-1 rows: own)
        self.held_rows = 0                    # rows that ran held experts other than the router's own set

    def load(self, bundle) -> None:
        if isinstance(bundle, (str, os.PathLike)):
            with open_kdtr(bundle) as f:
                return self.load(f)
        self.cfg, W = read_model(bundle, self.np_dtype)              # memory-mapped, upcast per matmul
        # A model that fits in memory is upcast once (the same rule as kdtr gen's): on the tiny bundles the
        # per-matmul upcasts (INT4 dequantization included) cost about a quarter of a verify run.
        self.W = upcast_if_fits(W, copies=1)
        self.dcfg, DW = read_drafter(bundle)
        self.ddtree_settings = bundle.metadata["ddtree"]                # budget, topk
        self.DW = {k: v.astype(self.np_dtype) for k, v in DW.items()}
        self.held_rows = 0
        self.reset()

    def reset(self) -> None:
        self.cache = KVCache(self.cfg, self.np_dtype)

    def _cos_sin(self, positions):
        """RoPE tables for `positions`: angles in float64, then cast (float32 angles are a fault at
        long positions: docs/golden-bundles.md, the long-position prompt)."""
        return rope_cos_sin(self.cfg, np.asarray(positions, np.int64), self.np_dtype)

    def hold_routing(self, ids: dict | None) -> None:
        """The expert sets the next forward runs ({layer: [T, K]}, a row of -1: the router decides;
        conformance/engines/protocol.py). The taps still report the router's own choice: its scores, its expert
        ids (refmodel.model.moe) and the weights of those ids."""
        self._held_ids = {int(l): np.asarray(v, np.int64) for l, v in (ids or {}).items()}

    def _forward(self, ids, positions, mask=None):
        taps, held, self._held_ids = {}, self._held_ids, {}             # held for one call only
        T = len(np.asarray(ids).reshape(-1))
        for l, v in held.items():
            if v.shape != (T, self.cfg.num_experts_per_tok):
                raise ValueError(f"hold_routing: layer {l} got held ids of shape {v.shape} for a forward of "
                                 f"{T} tokens; expected [{T}, {self.cfg.num_experts_per_tok}]")
        logits, _ = forward(self.cfg, self.W, ids, positions, self.cache, mask, taps=taps,
                            cos_sin=self._cos_sin(positions), forced_ids=held or None)
        for l, v in held.items():                                        # rows whose held set is not its own
            own = taps[f"L{l}/topk_ids"]
            self.held_rows += int(np.count_nonzero((v >= 0).all(-1) & (np.sort(v, -1) != np.sort(own, -1)).any(-1)))
            # the taps report the router's own decision (conformance/engines/protocol.py): its weights too
            taps[f"L{l}/topk_weights"] = expert_weights(self.cfg, taps[f"L{l}/router_scores"], own)
        return logits, taps

    def prefill(self, ids, positions):
        return self._forward(ids, positions)

    def decode(self, token, position):
        return self._forward([token], [position])

    def verify_tree(self, ids, positions, mask):
        return self._forward(ids, positions, mask)

    def compact(self, start, keep) -> None:
        self.cache.compact(start, keep)

    def ddtree_generate(self, prompt_ids, pos0: int, n_tokens: int) -> dict:
        """The engine's own DDTree loop (docs/ddtree.md §1): its drafter, its trees, its verify forwards,
        from an empty cache; the run-dump records of docs/run-dump.md §2, `ddtree_live/` group. Uses its
        own caches, not the one prefill/decode/verify_tree share."""
        budget, topk = self.ddtree_settings["budget"], self.ddtree_settings.get("topk")
        dec = prefill(self.cfg, self.W, np.asarray(prompt_ids, np.int64), self.dcfg, int(pos0))
        P, rounds = len(prompt_ids), []
        while len(dec.out) - P < n_tokens:
            tree = self.cut_tree(self.build_tree(draft_logits(self.W, self.dcfg, self.DW, dec), budget, topk))
            rounds.append(verify_round(self.cfg, self.W, self.dcfg, dec, tree))
        return self.records(live_records(dec.out[P:P + n_tokens], rounds, dec.counters.target_forwards), rounds)

    def records(self, live: dict, rounds: list) -> dict:
        """The live records as they go to the judge (CostAwareReference adds its per-round budgets)."""
        return live

    def cut_tree(self, tree: Tree) -> Tree:
        """The tree this engine verifies: the one it built (CostAwareReference cuts it)."""
        return tree

    def build_tree(self, draft_logits: np.ndarray, budget: int, topk: int | None) -> Tree:
        """The engine's tree builder: the reference's (a fault may plant another)."""
        return build_ddtree(draft_logits, budget, topk)

    def run_layer(self, layer: int, inputs: dict) -> dict:
        """Layer `layer` alone on golden inputs (hidden [T, D], positions [T], cache rows c_kv/k_pe [S, .])."""
        cfg, dt = self.cfg, self.np_dtype
        cache = KVCache(cfg, dt)
        cache.c_kv[layer] = np.asarray(inputs["c_kv"], dt)
        cache.k_pe[layer] = np.asarray(inputs["k_pe"], dt)
        h = np.asarray(inputs["hidden"], dt)
        positions = np.asarray(inputs["positions"], np.int64)
        mask = causal_mask(h.shape[0], cache.c_kv[layer].shape[0]).astype(dt)   # [T, S + T]
        cos, sin = self._cos_sin(positions)
        taps = {}
        block(cfg, self.W, layer, h, cos, sin, cache, mask, False, taps)
        return taps


class CostAwareReference(ReferenceEngine):
    """The reference with a cost-aware tree budget (docs/ddtree.md §3a): each round's tree, built with the
    bundle's budget, is cut to the node count that maximises expected tokens per unit cost under the
    drafter's own probabilities (refmodel.ddtree.cost_aware_nodes), for a verify cost per forward of T rows
    given as {rows: cost} points (refmodel.ddtree.verify_cost_table; e.g. a GPU engine's measured times) and
    a drafter cost; it declares each round's budget (`round_budget`, docs/run-dump.md §5). The stream stays
    the golden one (greedy exactness); the rounds and forwards change."""
    name = "reference-cost-aware"

    def __init__(self, verify_cost: dict, draft_cost: float = 0.0, dtype=np.float32):
        super().__init__(dtype)
        if not np.isfinite(draft_cost) or draft_cost < 0:
            raise ValueError(f"the drafter's cost per round must be finite and >= 0, got {draft_cost}")
        self.verify_cost, self.draft_cost = verify_cost_table(verify_cost), float(draft_cost)

    def cut_tree(self, tree: Tree) -> Tree:
        return prune_tree(tree, cost_aware_nodes(tree.scores, self.verify_cost, self.draft_cost))

    def records(self, live: dict, rounds: list) -> dict:
        return {**live, LIVE_BUDGET: np.asarray([len(r.tree_tokens) for r in rounds], np.int64)}
