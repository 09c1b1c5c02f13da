"""The protocol an engine under test implements (in prose: docs/engine-api.md); the runner drives it.

Taps are returned as a dict keyed by the names of docs/architecture.md, per call:
"L{l}/{tap}" for every layer l and tap (attn_in, q, kv_latent, k_pe, attn_out, resid_attn, mlp_in,
router_scores, topk_ids, topk_weights, mlp_out, resid_out; the three routing taps on MoE layers
only), plus "final_hidden" and "logits". Each value is [T, ...] for the T tokens of that call, as
NumPy arrays in the compute dtype (float32; bfloat16 as uint16 bit patterns; float16), topk_ids
int64: outputs of another dtype or shape are an engine error (conformance/verify/outputs.py). An engine may
return a subset (the runner reports the taps it lacks as skipped, and counts them in the coverage)
but never a tap under another name. An engine that raises makes the run an engine error
(ExitCode.ENGINE_ERROR).

A step of the model that kdtr performs for an engine is never counted as judged: an adapter that does so
(the torch engine: INT4 decoding, cache compaction) names it in `done_by_kdtr`, {step: why}, after `load`,
and an engine without `ddtree_generate` has kdtr's replay as its only DDTree run; the verdict lists them
under "done by kdtr, not judged" (conformance/verify/not_judged.py).

Legend: T tokens, V vocab, S cache length.
"""
from __future__ import annotations

import os
from typing import Any, Protocol

import numpy as np

Taps = dict[str, np.ndarray]


class Engine(Protocol):
    """An inference engine as the conformance runner sees it: one sequence, one KV cache."""

    name: str                           # shown in reports, e.g. "reference" or "cuda"
    dtype: str                          # compute dtype: "float32", "bfloat16" or "float16" (ULPs)
    supports_teacher_forcing: bool      # True if run_layer() works (local vs inherited error)

    def load(self, bundle: str | os.PathLike | Any) -> None:
        """Load the model from a bundle path or an open KdtrFile (weights under HF names, config in
        the metadata). Leaves an empty cache."""

    def reset(self) -> None:
        """Drop the KV cache; the next call starts a new sequence. Its positions are the ones passed to
        prefill/decode/verify_tree, never derived from the cache length: a bundle's long-position prompt
        starts at a large position with an empty cache (docs/golden-bundles.md)."""

    def prefill(self, ids: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, Taps]:
        """Run ids [T] at positions [T] causally, appending T rows to the cache.
        Returns logits [T, V] and taps for these T tokens."""

    def decode(self, token: int, position: int) -> tuple[np.ndarray, Taps]:
        """One token at `position`, attending to the whole cache; appends one row.
        Returns logits [1, V] and taps with T = 1."""

    def verify_tree(self, ids: np.ndarray, positions: np.ndarray,
                    mask: np.ndarray) -> tuple[np.ndarray, Taps]:
        """DDTree verification: ids [T] and positions [T] of the tree nodes; mask [T, S + T] is
        additive (0 visible, -inf hidden) over the S cached rows and the T nodes, exactly the
        refmodel.model.forward convention. Appends T rows to the cache (compact() keeps the
        accepted ones). Returns logits [T, V] and taps."""

    def compact(self, start: int, keep: np.ndarray) -> None:
        """Keep cache rows start + keep[i] at start + i and truncate to start + len(keep)
        (KVCache.compact): drop the rejected tree nodes after a verify."""

    def ddtree_generate(self, prompt_ids: np.ndarray, pos0: int, n_tokens: int) -> dict[str, np.ndarray]:
        """Optional: the engine's OWN greedy DDTree loop (docs/ddtree.md §1): its drafter (the bundle's
        `drafter.*` weights and `drafter_config`), its trees (budget and top-k from the bundle's `ddtree`
        metadata), its verify forwards, from an empty cache and independent of the cache the calls above
        share. The prompt [P] sits at positions pos0 .. pos0 + P - 1 (the bundle's position offset of
        that prompt, 0 for an ordinary one); decoding stops once n_tokens are generated. Returns the
        records of docs/run-dump.md §2, names relative to the `ddtree_live/` group: tokens [n_tokens],
        tree_tokens and tree_parents (its trees in the bundle's layout, a root row first per round),
        verify_argmax, accepted, accepted_offsets, round_bonus, counters [target forwards, rounds] and
        path_logits; and round_budget [rounds] when the engine cuts its trees to a budget of its own (a
        cost-aware budget, docs/ddtree.md §3a). The runner calls it after the golden replay when the engine
        has it."""

    def hold_routing(self, ids: dict[int, np.ndarray] | None) -> None:
        """Optional: the expert sets the NEXT prefill/decode/verify_tree call computes its MoE layers with,
        {layer: [T, K] int64 expert ids}, a row of -1 meaning "the router decides"; None or a missing layer:
        the router decides. It holds for that one call. The engine still reports its own router's
        router_scores, topk_ids and topk_weights; only the experts it runs change, weighted from its own
        scores at the held ids (normalised and scaled as its router does). The runner holds routing to the
        golden sets under a profile derived that way (bf16; fp32 on a bundle made with
        `kdtr gen --routing-near-ties held`), so a near-tie expert flip is judged once, at its topk_ids,
        instead of moving every later tap (docs/conformance.md §3a)."""

    def run_layer(self, layer: int, inputs: Taps) -> Taps:
        """Optional: engines with supports_teacher_forcing False may omit it. Run layer `layer` alone on golden inputs
        and return its taps, so the runner can tell a local fault from inherited error.
        `inputs` holds "hidden" [T, D] (the golden input of the layer), "positions" [T], and
        "c_kv" [S, C] and "k_pe" [S, R], the golden cache rows before these tokens (empty S = 0
        for a prefill). Does not touch the engine's own cache."""


def compact_keep(start: int, keep, length: int) -> np.ndarray:
    """compact(start, keep)'s arguments checked against a cache of `length` rows: keep as int64 [n], each
    index in [0, length - start), strictly increasing (an accepted path), start in [0, length]; a ValueError
    naming the values otherwise. One check for the engines kdtr ships (examples/ keep their own: they stand
    alone)."""
    keep = np.asarray(keep, np.int64).reshape(-1)
    if not 0 <= start <= length:
        raise ValueError(f"compact: start={start} must be in [0, length={length}]")
    if keep.size and (keep.min() < 0 or keep.max() >= length - start):
        raise ValueError(f"compact: keep indices {keep.tolist()} must be in [0, {length - start})")
    if keep.size > 1 and np.any(np.diff(keep) <= 0):
        raise ValueError(f"compact: keep {keep.tolist()} must be strictly increasing (an accepted path)")
    return keep


def check_engine(engine: object) -> list[str]:
    """What `engine` lacks to be an Engine, as readable lines (empty when it conforms).
    The runner calls this before a run so a missing method is a usage-level message,
    not an AttributeError in the middle of step 37."""
    problems = []
    for attr, kind in (("name", str), ("dtype", str), ("supports_teacher_forcing", bool)):
        if not isinstance(getattr(engine, attr, None), kind):
            problems.append(f"attribute {attr!r} missing or not a {kind.__name__}")
    for meth in ("load", "reset", "prefill", "decode", "verify_tree", "compact"):
        if not callable(getattr(engine, meth, None)):
            problems.append(f"method {meth}() missing")
    for meth in ("ddtree_generate", "hold_routing"):
        if hasattr(engine, meth) and not callable(getattr(engine, meth)):
            problems.append(f"{meth} is present but not a method")
    if getattr(engine, "supports_teacher_forcing", False) and not callable(
            getattr(engine, "run_layer", None)):
        problems.append("supports_teacher_forcing is True but run_layer() is missing")
    dtype = getattr(engine, "dtype", None)
    if isinstance(dtype, str) and dtype not in ("float32", "bfloat16", "float16"):
        problems.append(f"dtype must be 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    return problems
